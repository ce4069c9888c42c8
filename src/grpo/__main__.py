"""``python -m grpo`` (used by torchrun launches) is the ``grpo`` command."""

import sys

from grpo.cli import main

sys.exit(main())
