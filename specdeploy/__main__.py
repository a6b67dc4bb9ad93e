from .console import main

try:
    main()
finally:
    # Under `python -m`, CPython exits by SIGINT in place of our exit code 130 once a Ctrl-C has escaped
    # code run from a string (dataclasses builds its methods with exec(str)), even if we caught it later;
    # every string exec clears that flag as it starts, so an empty one here does. An uncaught Ctrl-C
    # still ends the process by SIGINT: the flag is set again as it leaves this module.
    exec("")
