"""``python -m kvstore.cli``: the ``kvstore`` command."""

import sys

from kvstore.cli.commands import main

sys.exit(main())
