from pystronghold.cli import main

raise SystemExit(main())
