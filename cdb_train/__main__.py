"""``python -m cdb_train``: see ``cdb_train.cli``."""

from cdb_train.cli import main

raise SystemExit(main())
