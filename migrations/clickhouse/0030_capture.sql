-- 0030: whether a request's turn was handed to the capture queue (spec.memory.capture), per trace row.
ALTER TABLE llm_traces ADD COLUMN IF NOT EXISTS captured UInt8 DEFAULT 0;
