"""Studies of the engine's cost and acceptance (round profiles, replays of
adaptive rules, acceptance probes, the whole-run account). Scripts use them;
nothing in the package imports them."""
