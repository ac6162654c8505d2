import sys

from appo_trl.cli import main

sys.exit(main())
