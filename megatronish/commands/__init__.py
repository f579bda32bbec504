"""The CLI commands that are not a stage of a run: check, plan, bench, launch, diagnose, plot
and trace. Each module holds one command's work; megatronish.cli parses the arguments."""
