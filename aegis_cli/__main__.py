from aegis_cli.cli import main

main()
