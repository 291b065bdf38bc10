import sys

from dmltrain.cli import main

sys.exit(main())
