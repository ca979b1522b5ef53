import sys

from cdb.cli import main

sys.exit(main())
