from zoff.cli import main

main()
