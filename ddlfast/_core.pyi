# For the type checker (mypy) only: the compiled module _core, every name Any.
from typing import Any

def __getattr__(name: str) -> Any: ...
