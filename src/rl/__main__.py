from rl.cli.main import main

main()
