"""``python -m grpo`` (used by torchrun launches) is the ``grpo`` command."""

import os
import sys

from grpo.cli import main

code = main()
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    # A torchrun rank whose work is done and flushed exits without tearing down its process groups and
    # DDP wrappers: their destructors can deadlock on the GIL (grpo.parallel.distributed.keep_until_exit).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
sys.exit(code)
