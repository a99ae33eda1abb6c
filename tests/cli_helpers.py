"""What the command-line tests share."""

from minipaged.cli import main


def run_main(argv: list[str]) -> int:
    """``main(argv)``'s exit status, whether it returns or exits the way argparse does."""
    try:
        return main(argv)
    except SystemExit as exit:
        return exit.code
