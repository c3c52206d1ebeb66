import sys

from llm_runner_svc.cli import main

sys.exit(main())
