from ddpscope.cli.main import main

raise SystemExit(main())
