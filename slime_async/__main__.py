from slime_async.cli import main

raise SystemExit(main())
