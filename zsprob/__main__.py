from zsprob.cli import main

main()
