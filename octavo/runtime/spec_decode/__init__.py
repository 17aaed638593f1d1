"""Speculative decoding: proposers guess the next tokens, the target verifies them in one step.

A proposer (`ngram`: prompt lookup; `draft`: a smaller artifact with the same tokenizer) suggests up
to k tokens after a sequence's newest token. The target scores the newest token and the k proposals
as k + 1 query tokens of that sequence in the step's flattened batch; rejection sampling accepts a
prefix of the proposals and draws one more token, so the emitted tokens follow exactly the target's
sampling distribution. Rejected positions are rolled back by shortening the sequence. A cost model
measured on the running machine decides how many tokens to propose (or none).
"""
