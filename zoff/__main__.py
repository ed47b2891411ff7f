from zoff.cli import entry

entry()
