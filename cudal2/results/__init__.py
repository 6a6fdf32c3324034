"""Results: the leaderboard, the floor and regime of a time, and how results are shown and reported."""
