"""The trainer side: front ends, the engine, the channels to the workers and the receive loop."""
