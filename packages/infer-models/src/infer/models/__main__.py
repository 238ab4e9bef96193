import sys

from infer.models.cli import main

sys.exit(main())
