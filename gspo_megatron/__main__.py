from gspo_megatron.train import main

if __name__ == "__main__":
    main()
