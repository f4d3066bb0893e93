"""`python -m shardless ...`: the `shardless` command line."""

import sys

from shardless.processor.cli import main

sys.exit(main())
