"""DDP: torchrun --standalone --nproc_per_node=2 -m dpbook.torch.ddp_minimal"""
import gc
from torch import cuda, distributed as dist, nn, optim
from torch.utils.data import DataLoader, DistributedSampler
from dpbook.torch import get_scale, lenet
from dpbook.torch.data import fashion_mnist_datasets as datasets
if __name__ == '__main__':  # torchrun starts this in every process
    device = 'cuda' if cuda.is_available() else 'cpu'  # a GPU for each process
    if device == 'cuda':  # NCCL works on the current GPU: make it LOCAL_RANK's
        cuda.set_device(dist.get_node_local_rank())
    dist.init_process_group('nccl' if device == 'cuda' else 'gloo')
    net = nn.parallel.DistributedDataParallel(lenet().to(device))  # rank 0's
    train, _ = datasets(get_scale().num_train, normalize=True)
    sampler = DistributedSampler(train)  # a different part for every rank
    train_iter = DataLoader(train, batch_size=64, sampler=sampler)  # per rank
    optimizer = optim.SGD(net.parameters(), lr=0.1)
    for epoch in range(3):
        sampler.set_epoch(epoch)  # a new shuffle, the same on all ranks
        total = 0.0
        for X, y in train_iter:
            loss = nn.functional.cross_entropy(net(X.to(device)), y.to(device))
            optimizer.zero_grad()
            loss.backward()  # DDP averages the gradients here
            optimizer.step()
            total += loss.item() / len(train_iter)
        if dist.get_rank() == 0:  # one process prints for all
            print(f'epoch {epoch + 1}: loss {total:.4f} (rank 0)')
    del net  # free DDP before its group: with gloo, a recent PyTorch can abort
    gc.collect()
    dist.destroy_process_group()
