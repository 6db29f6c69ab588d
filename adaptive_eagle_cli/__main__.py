from adaptive_eagle_cli import main

main()
