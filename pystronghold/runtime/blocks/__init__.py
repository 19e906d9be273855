"""How the engine gets into the model: finding the blocks, checking them, the autograd Function
around each, side outputs, autocast state, the inputs of a call."""
