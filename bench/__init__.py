"""dflash_llama.bench"""
