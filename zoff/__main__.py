"""The `zoff` command (the console script) and `python -m zoff`."""

from zoff.cli import main
from zoff.host.process_exit import exit_code, exit_now


def entry() -> None:
    """main(), then the process ends without the interpreter's teardown (host/process_exit.py: ~0.8 s a
    command with torch loaded). An exception main() lets through keeps the interpreter's traceback and exit."""
    try:
        main()
        code = 0
    except SystemExit as e:
        code = exit_code(e.code)
    exit_now(code)


if __name__ == "__main__":  # (a rank imports this module as the console script's: it must not run again)
    entry()
