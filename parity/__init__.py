"""dflash_llama.parity"""
