from exokv.cli.app import main

main()
