from exokv.cli import main

main()
