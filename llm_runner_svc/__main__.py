import sys

from services.launched import leave_interrupts_to_parent

leave_interrupts_to_parent()  # before the CLI imports numpy and the engines

from llm_runner_svc.cli import main  # noqa: E402

sys.exit(main())
