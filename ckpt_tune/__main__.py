from ckpt_tune.cli import main

main()
