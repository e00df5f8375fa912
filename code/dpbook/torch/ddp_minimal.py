"""DDP: torchrun --standalone --nproc_per_node=2 -m dpbook.torch.ddp_minimal"""
import gc
import torch
from torch import distributed as dist, nn
from torch.utils.data import DataLoader, DistributedSampler
from dpbook.torch import get_scale, lenet
from dpbook.torch.data import fashion_mnist_datasets as datasets
if __name__ == '__main__':  # torchrun starts this in every process
    cuda = torch.cuda.is_available()  # then NCCL, and GPU number LOCAL_RANK
    device = f'cuda:{dist.get_node_local_rank()}' if cuda else 'cpu'
    if cuda: torch.cuda.set_device(device)  # NCCL works on the current GPU
    dist.init_process_group('nccl' if cuda else 'gloo')  # reads RANK etc.
    net = nn.parallel.DistributedDataParallel(lenet().to(device))  # rank 0's
    train, _ = datasets(get_scale().num_train, normalize=True)
    sampler = DistributedSampler(train)  # a different part for every rank
    train_iter = DataLoader(train, batch_size=64, sampler=sampler)  # per rank
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
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
    del net; gc.collect()  # free DDP before its group (gloo can abort)
    dist.destroy_process_group()
