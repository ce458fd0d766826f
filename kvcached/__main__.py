import sys

from kvcached.cli.main import main

sys.exit(main())
