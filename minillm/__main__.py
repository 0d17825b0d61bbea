import sys

from minillm.course.cli import main

sys.exit(main())
