"""``python -m services.settings``: print the tables of the ``CDB_*`` variables (the package's docstring)."""

from services.settings.table import variables_table

print(variables_table(), end="")
