"""python -m profiling ... == glm5-lab ..."""
from .cli import main

raise SystemExit(main())
