"""FX graph passes users may run themselves (weld runs some of them too)."""
