"""Search: where candidates come from (the proposers) and what ranks them (the cost model)."""
