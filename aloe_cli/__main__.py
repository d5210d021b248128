"""``python -m aloe_cli``: the ``aloe`` command."""

import sys

from .main import main

sys.exit(main())
