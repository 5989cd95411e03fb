from treepack.cli.app import main

main()
