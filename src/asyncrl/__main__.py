from asyncrl.main import main

main()
