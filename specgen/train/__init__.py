"""`specgen train-head`: an EAGLE-3 head trained for any target (data.py records what the
target computes, ttt.py is the training-time test, loop.py trains, checkpoints and resumes)."""
