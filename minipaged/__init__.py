"""minipaged"""
