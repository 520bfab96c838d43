import sys

from engine.server.cli import main

sys.exit(main())
