"""One-off investigations behind the method cards' numbers (ghost engine cost, sketch error, utility ranking, ...)."""
