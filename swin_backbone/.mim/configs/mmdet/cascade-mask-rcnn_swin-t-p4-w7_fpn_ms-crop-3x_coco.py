# Cascade Mask R-CNN + FPN, Swin-T, 3x multi-scale-crop: the Swin paper's recipe
# (4conv1fc box heads with SyncBN and GIoU loss; published box 50.4 / mask 43.7 AP).
# Data pipeline, schedule and optimizer come from the Mask R-CNN 3x config.
_base_ = './mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py'

norm_cfg = dict(type='SyncBN', requires_grad=True)


def _box_head(target_stds):  # noqa: E302  (mmengine configs may define helpers)
    return dict(
        type='Shared4Conv1FCBBoxHead',
        in_channels=256,
        conv_out_channels=256,
        fc_out_channels=1024,
        roi_feat_size=7,
        num_classes=80,
        bbox_coder=dict(
            type='DeltaXYWHBBoxCoder',
            target_means=[0., 0., 0., 0.],
            target_stds=target_stds),
        reg_class_agnostic=False,
        reg_decoded_bbox=True,
        norm_cfg=norm_cfg,
        loss_cls=dict(type='CrossEntropyLoss', use_sigmoid=False, loss_weight=1.0),
        loss_bbox=dict(type='GIoULoss', loss_weight=10.0))


def _rcnn_train(iou):  # noqa: E302
    return dict(
        assigner=dict(
            type='MaxIoUAssigner',
            pos_iou_thr=iou,
            neg_iou_thr=iou,
            min_pos_iou=iou,
            match_low_quality=False,
            ignore_iof_thr=-1),
        sampler=dict(type='RandomSampler', num=512, pos_fraction=0.25, neg_pos_ub=-1, add_gt_as_proposals=True),
        mask_size=28,
        pos_weight=-1,
        debug=False)


model = dict(
    type='CascadeRCNN',
    roi_head=dict(
        _delete_=True,
        type='CascadeRoIHead',
        num_stages=3,
        stage_loss_weights=[1, 0.5, 0.25],
        bbox_roi_extractor=dict(
            type='SingleRoIExtractor',
            roi_layer=dict(type='RoIAlign', output_size=7, sampling_ratio=0),
            out_channels=256,
            featmap_strides=[4, 8, 16, 32]),
        bbox_head=[
            _box_head([0.1, 0.1, 0.2, 0.2]),
            _box_head([0.05, 0.05, 0.1, 0.1]),
            _box_head([0.033, 0.033, 0.067, 0.067]),
        ],
        mask_roi_extractor=dict(
            type='SingleRoIExtractor',
            roi_layer=dict(type='RoIAlign', output_size=14, sampling_ratio=0),
            out_channels=256,
            featmap_strides=[4, 8, 16, 32]),
        mask_head=dict(
            type='FCNMaskHead',
            num_convs=4,
            in_channels=256,
            conv_out_channels=256,
            num_classes=80,
            loss_mask=dict(type='CrossEntropyLoss', use_mask=True, loss_weight=1.0))),
    train_cfg=dict(rcnn=[_rcnn_train(0.5), _rcnn_train(0.6), _rcnn_train(0.7)]))
