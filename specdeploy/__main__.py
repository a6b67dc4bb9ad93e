from .cli import main

try:
    main()
finally:
    # Under `python -m`, CPython exits by SIGINT instead of our exit code 130 when a Ctrl-C once
    # interrupted code run from a string (dataclasses builds its methods with exec(str)), even though
    # we caught it; every string exec clears that flag when it starts, so an empty one here does.
    exec("")
