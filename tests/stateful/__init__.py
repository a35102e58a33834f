"""Model-based (stateful) tests: Hypothesis drives kvref the way a scheduler would
and checks it against small, obviously correct models after every step."""
