import sys

from tpulab.cli.main import main

sys.exit(main())
