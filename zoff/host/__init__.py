"""What describes the host zoff runs on, read by the layers above: where zoff caches what it builds (cache)
and where the installed torch stands against the releases zoff is checked on (versions)."""
