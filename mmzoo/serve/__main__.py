from mmzoo.serve.app import main

main()
